"""Damaged and crafted checkpoints and hostile local storage: every tool
refuses them with a clear error, never runs their code, never loads wrong data."""
