"""LocalAI's own formats, read and written as LocalAI does: model configs, Go templates, GBNF
grammars, tool-call parsing and what a backend can do.  Pure code: it imports nothing of this
project but the base modules, so the frontend, the tools and the tests share one reading."""
