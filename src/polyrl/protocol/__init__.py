"""The vocabulary every role imports and no role owns: the models that cross a process
boundary, so that both sides of a wire use one class. `worker_api`: the worker's HTTP API
(the manager's requests to workers, and their replies)."""
