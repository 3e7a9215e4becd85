"""LocalAI's model gallery on a cluster: the indexes, installs and deletes as jobs every replica
can answer, and the rule for what a request's ``overrides`` may change (docs/models.md)."""
