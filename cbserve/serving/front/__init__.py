"""Where a request arrives (the Serve ingress, the batch job's driver): parsing, limits, one
`WorkerRequest` per choice, and the fold of the replicas' events into replies. No model, no
tokenizer."""
