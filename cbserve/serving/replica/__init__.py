"""Next to the engine (an engine replica, a batch engine actor): one `WorkerRequest` on a
manager, its events streamed back."""
