-- backend_nodes.approved_at: when an administrator approved the node (POST
-- /api/nodes/{id}/approve).  NULL for a node admitted without anyone's approval (registration
-- without --require-approval): /api/nodes and the dashboard say such a node is unapproved, and
-- new while it is young (issue 21 §6).  Rows from before this column are NULL too.
ALTER TABLE backend_nodes ADD COLUMN approved_at timestamptz NULL;
