"""orchestrator: prefix reuse for hybrid recurrent LLMs through llama.cpp state snapshots."""
