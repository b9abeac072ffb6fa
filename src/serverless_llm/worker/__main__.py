"""`python -m serverless_llm.worker`: the RunPod worker (the image's command)."""

from .handler import main

if __name__ == "__main__":
    main()
