"""Driver code: the commands' work on the machine that submits a job. Only this layer (and the command
line above it) starts or joins Ray."""
