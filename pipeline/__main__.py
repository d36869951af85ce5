from pipeline.cli import entry

if __name__ == "__main__":  # vLLM spawns its engine process: entry points need the guard.
    entry()
