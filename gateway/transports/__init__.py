"""The transports: each turns one kind of socket into calls on the client registry and the topic router,
and the scheduler's batches into writes (docs/architecture.md)."""
