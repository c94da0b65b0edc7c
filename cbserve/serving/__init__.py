"""The OpenAI and gRPC protocol, without Ray, by where it runs.

- `front/`: where a request arrives (the Serve ingress, the batch job's driver): the HTTP wire
  format (`schemas.py`, `json_body.py`), `openai_service.py`, `grpc_service.py`,
  `worker_requests.py` (one `WorkerRequest` per choice, its sampling block, the fronts' limits),
  `prefix.py` (routing hashes), `replies.py` + `chat_replies.py` + `tool_calls.py` (the one fold
  of a choice's events and its renderings), `metrics.py` (the ingress's Prometheus series),
  `service_args.py` (the deployment's defaults and limits).
- `replica/`: next to the engine, in an engine replica or a batch engine actor: `generation.py`
  (one request on a manager: tokenize, submit, stream events), `detokenizer.py`.
- here, what both sides share: `protocol.py` (what a front sends a replica and what it streams
  back), `api_errors.py` (OpenAI's error shape, refusals by field, error events), and the
  concepts whose two halves run on each side: `chat_template.py` (messages on the front, their
  rendering on the replica), `constraints.py` (requested on the front, compiled on the replica),
  `tokenization.py` (vLLM's tokenizer routes), `protos/`.

`cbserve.cluster` puts them on Ray Serve; `cbserve.batch` uses them in a Ray job.
"""
