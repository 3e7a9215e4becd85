-- cluster state: instances, backend_nodes, node_labels, node_connections (owned by the cluster layer)
SELECT 1;
