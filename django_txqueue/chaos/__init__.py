"""``manage.py txqueue_chaos``: ``run`` drives a drain under faults, ``consumer`` is the
consumer process it starts, ``verify`` audits what happened. Nothing here is imported
before Django is set up (the consumer process starts as ``python -m``)."""
