"""Payments: a RabbitMQ consumer that moves payments through states with StateMachine."""
