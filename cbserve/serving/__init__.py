"""The OpenAI and gRPC protocol, without Ray.

`protocol.py` (what a front sends an engine replica and what it streams back), `generation.py`
(one request on a manager: tokenize, submit, stream events), `detokenizer.py`, `prefix.py`
(routing hashes), `requests.py` (building worker requests, the fronts' limits), `replies.py`
(the one fold of a choice's events, and its OpenAI renderings), `openai_service.py`,
`grpc_service.py` and `protos/`, `schemas.py` and `json_body.py` (the HTTP wire format),
`errors.py` (OpenAI's error shape; refusals by field), `metrics.py`, `settings.py`.
`cbserve.cluster` puts them on Ray Serve; `cbserve.batch` uses them in a Ray job.
"""
