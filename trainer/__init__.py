"""Training loop: asynchronous PPO with the decoupled objective, checkpoint publishing."""
