"""The vocabulary every role imports and no role owns: the models that cross a process
boundary or a role's, so that both sides use one class. `sampling`: how samples are drawn,
one `SamplingParams` from the trainer's config to the engine. `manager_api`: the rollout
manager's API (workers registering and beating, the trainer's batches). `worker_api`: the
worker's HTTP API (the manager's requests to workers, and their replies). `samples`: the
prompt, the sample and the group, from the data sources through the rollout sources to the
learner. `version`: the policy's weight version, and what every role may assume of it.
`ids`: the names several roles must spell the same way."""
