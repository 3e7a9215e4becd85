-- bus: bus_messages (spill), work_claims (claim queue)
SELECT 1;
