-- node_models.note: what the worker changed when it started this model's backend, as its
-- backend.start answered (e.g. llama.cpp's extra buffer types turned off after a crash on an AMX
-- CPU, backends/amx_fallback.py); shown in /api/nodes.  '' when nothing changed.
ALTER TABLE node_models ADD COLUMN note varchar(1024) NOT NULL DEFAULT '';
