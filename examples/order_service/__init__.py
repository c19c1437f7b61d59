"""Order service: a Kafka consumer that writes orders and outbox rows; the relay publishes."""
