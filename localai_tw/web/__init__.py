"""The HTTP pieces both servers share (the frontend's API listener and the worker's tunnel-fed
site): one bearer rule, one bounded request body and early answer, one way to write a JSON
answer, one bounded reader of response bodies.  Base level: imports nothing of ours."""
