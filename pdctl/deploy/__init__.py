"""Deployment operations behind ``pdctl``: env files with secrets, rolling replacement and
drain-aware scaling of workers (docker compose or the local launcher), metrics discovery."""
