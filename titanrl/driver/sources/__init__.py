"""Where each step's rollouts come from: lock-step requests (`lockstep`) or continuous
generation into the trajectory buffer (`continuous`, `buffer`)."""
