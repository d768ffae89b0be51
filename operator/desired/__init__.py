"""Pure desired state: spec + configs -> plan -> children -> status. Imports neither kopf, kubernetes nor httpx."""
