"""Media generation plumbing shared by the video and image routes and engines.

* :mod:`~penstock.multimodal.limits` - what a request may ask of a model (sizes, frame counts)
  and how defaults are resolved; the engine advertises its limits, the gateway enforces
  them before a job is accepted;
* :mod:`~penstock.multimodal.encoding` - frames to H.264 MP4 (PyAV), images to PNG/WEBP/JPEG
  (Pillow), reference images in;
* :mod:`~penstock.media.records` - what a video job is, with no database imported;
* :mod:`~penstock.media.jobs` - the job store (SQLAlchemy: SQLite, or PostgreSQL to share
  the jobs between gateways), opened only by servers whose models generate media;
* :mod:`~penstock.media.async_jobs` - the job store's calls off the event loop, each
  bounded, and the startup check of a ``--media-db`` URL;
* :mod:`~penstock.media.artifacts` - generated files (a folder or any fsspec URL);
* :mod:`~penstock.media.pool` - the bounded worker pool generations run in;
* :mod:`~penstock.media.service` - the above put together for one gateway process.
"""
