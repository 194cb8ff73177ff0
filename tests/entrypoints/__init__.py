"""Tests of the OpenAI-compatible server and the tokenmill command."""
