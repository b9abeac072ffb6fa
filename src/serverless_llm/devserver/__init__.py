"""The local endpoint: the hosted platform's routes (OpenAI under /openai/v1, and the job API
/run, /runsync, /stream, /status, /cancel, /health) in front of the worker's own handler.
Start it with `python -m serverless_llm.devserver`; build the app with `app.create_app`.
"""
