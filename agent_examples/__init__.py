"""Agents that drive a traindx server over a real MCP client, and recorded sessions that tests replay."""
