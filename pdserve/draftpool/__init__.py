"""The draft pool: drafts for every decode worker from the whole fleet's text (a suffix index served over NATS)."""
