"""Demo and training code: a tiny model pair made on this machine. Never imported by the engine proper."""
