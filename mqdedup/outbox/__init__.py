"""The transactional outbox: rows written in the business transaction, published later."""
