"""Optional apps of tools that run on your own database, each added to ``INSTALLED_APPS``
when wanted (as ``django.contrib`` apps are): ``django_txqueue.contrib.bench``
(``txqueue_bench``) and ``django_txqueue.contrib.chaos`` (``txqueue_chaos``).

They use the queue as any project does; the queue app imports nothing from here.
"""
