"""Optimizers: optax building blocks in torch's exact form (`transforms`), and DeepSpeed's optimizer and
scheduler sections translated into them (`deepspeed`, `schedules`)."""
