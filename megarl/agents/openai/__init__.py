"""`agent_loop=openai`: the OpenAI-compatible session server and the loop that runs a user's openai-client agent."""
