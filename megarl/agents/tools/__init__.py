"""Tools an agent loop can call: `BaseTool`, the YAML tool config loader and the shipped tools."""
