"""Stored responses of the Responses API: the conversations ``previous_response_id`` continues.

:mod:`penstock.responses.store` holds them in the job database through SQLAlchemy;
:mod:`penstock.responses.async_store` is how the event loop reaches it, opening it on the
first request that needs it (a server whose clients never use the Responses API never
imports SQLAlchemy for it).
"""
