"""`python -m minisgl --model M ...`: the OpenAI-compatible server."""

from minisgl.server.launcher import main

if __name__ == "__main__":
    main()
