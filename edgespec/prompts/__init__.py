"""Prompts laid out for the model: chat templates (chat), fill-in-the-middle (fim) and tool calls (tools)."""
