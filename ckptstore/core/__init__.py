"""The engine behind :class:`~ckptstore.CheckpointStore`: every step of the
publication protocol (``protocol_spec/PROTOCOL.md``) that touches storage.

Training code does not import this package; it uses the facade
(:mod:`ckptstore.store`). The pure decisions (record formats, names, which
save is selected, what gc may delete) live in :mod:`ckptstore.protocol`.

The layer order of the whole core, bottom to top. A module imports only
modules listed above it (modules of ``protocol`` form one layer); this block
is the one written copy, and ``tests/house/test_layers.py`` reads it::

    errors                    the one exception hierarchy
    util.redact               credentials out of messages and records
    util.terminal             storage strings made safe to print
    util.progress             a progress bar on a terminal, silence elsewhere
    util.prometheus           Prometheus metrics through prometheus-client (extra metrics)
    util.files                directory fsync, atomic replace
    util.shutdown             work at interpreter exit while thread pools still take it
    defaults                  the budget and gc-grace defaults
    protocol                  records, layout, selection, gc plan (pure, no I/O)
    identity                  what makes two processes the same experiment
    retry                     the one backoff policy
    backends.base             the Backend interface
    backends.memory           in-process backend
    backends.posix            no-follow POSIX primitives
    backends.local            a local directory (link/rename commit)
    backends.fsspec_base      shared code of the fsspec object stores
    backends.s3               S3 (conditional PUT commit)
    backends.gcs              GCS (generation-precondition commit)
    backends.obstore_s3       S3 through obstore (optional transport)
    backends.faults           a fault-injecting wrapper around any backend
    backends.schemes          URL schemes to backends
    core.hashing              chunk streams hashed while written
    core.preflight            checks before anything is written
    core.bounded_io           one run's I/O: retried, bounded, verified
    core.record_auth          keys and record tags in use
    core.binding              a run ID bound to its identity (RUN.json)
    core.fencing              attempts, fences, heartbeats
    core.commit_names         which commit records a run has, newest first
    core.selection_limits     what selection may conclude without reading
    core.piece_evidence       when a known piece may be reused unread (the re-hash rule), the pieces listing
    core.intents              save intents and the timing every writer and gc agree on
    core.piece_deadlines      what a rank's part must satisfy when the coordinator commits it
    core.piece_reads          pieced components checked and read, what another store lacks
    core.pieces               pieces addressed by content, written: the piece writer, a save's pieces
    core.record_pack          a cache of a run's commit-record bytes in one object (S3)
    core.catalog              the candidate walk: select, list, verify
    core.writer               stage and publish a save
    core.reader               verified reads
    core.collector            garbage collection carried out
    core.ledger               the append-only event ledger
    core.resume_point         the save a writer resumes from
    core.signing              signing an existing run after the fact
    core.one_tier             the one-tier placement: saves in the backend alone
    options                   the one options object and the one table of refused combinations
    tiers.tier_dir            the tier's folders opened without following links, kept apart from the durable run
    tiers.local               the local tier: mirror, selection judged by durable attempts, gc
    tiers.durable_intent      the replicator's save intent in the durable tier (version 3)
    tiers.durable_copy        one save copied to the durable tier: verified uploads, early uploads, the durable commit
    tiers.replicator          background replication to the durable tier, in commit order
    tiers.parts               many ranks: rank folders, local holdings, each rank's replication step
    tiers.peer_frames         peer copies on the wire: frames, and a received part written verified
    tiers.peer_repair         peer copies at resume: holdings, the plan (zombies by durable attempts), write-back
    tiers.peer_copies         many nodes: who holds whom, the background copy thread
    tiers.tiered              the two tiers joined: save, select, resume, read, gc per tier
    placement                 the interface the facade delegates to; the one choice of placement
    store                     the public facade
"""
