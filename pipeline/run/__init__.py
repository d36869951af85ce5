"""Running a job: job.py wires the stages onto Ray Data and publishes; plan.py turns one
config into each stage's settings; pool.py is the engine pool on Ray; limits.py keeps
learned batch limits between runs."""
