"""Planning a fleet: a discrete-event model of RL steps over measured rates (`polyrl plan`)."""
