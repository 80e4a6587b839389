// Package client is the Go engine SDK of kvactors: everything protocol v2
// (docs/PROTOCOL.md, "Engine checklist") asks of an inference engine, so
// that an engine author calls one method per scheduler event and one Flush
// per scheduler step, and gets told when GPU blocks may be reused.
//
// What it owns:
//   - the session: register (retried with backoff until the context ends,
//     while no node answers or one answers "node overloaded"),
//     the node and boot that answered, heartbeats every lease/4, node-loss
//     detection (no node heartbeat for lease_ms, or a reply from another
//     boot to a request sent after the register; another boot in any other
//     message may be an older process's, delivered late, so it is probed
//     with a heartbeat first, and one older than the registered boot is
//     ignored from then on), re-registering at once when a heartbeat reply from
//     the registered boot says "unknown engine" (one from another boot is
//     ignored: on a cluster a node that dropped the engine may say it
//     while another owns it) and, after the lease wait, re-registering
//     every lease/4 (a refusal then is retried too, since it may pass, but
//     logged at Warn, counted in Stats and passed to
//     Config.OnRegisterRefused);
//   - delivery: a random epoch per session, seq 1, 2, ... per batch, one
//     batch per Flush (several, in order, for a step over
//     Config.MaxBatchBytes), and a resync (new epoch re-announcing every live
//     request) on P.E.resync, on a lost release (an rseq gap or a
//     heartbeat reply counting more releases than arrived), on a lost tail
//     the node's resync did not report (a batch still unapplied a heartbeat
//     period later), on a new boot or re-register, on a batch the NATS
//     client refused, and at once after its own NATS reconnect (it listens
//     for the connection's CONNECTED status; a ReconnectHandler the caller
//     set stays theirs). A resync whose
//     reason is overflow (the node's intake was full) waits first:
//     Config.OverflowBackoff, doubling with each overflow within a lease up
//     to lease/4, each wait drawn from [½, 1] of it; batches flushed
//     meanwhile are held (the resync re-announces them), because every
//     engine re-announcing at once into a full intake overflows it again.
//     No resync starts while the connection is down (its batches would be
//     refused, and each try is another epoch re-announcing everything):
//     it starts at the reconnect (also when an overflow's wait ended
//     meanwhile), the steps meanwhile held likewise;
//   - releases: a request that finished or was preempted is free only on a
//     `released` for the current epoch (from a v2 node, numbered: one
//     without epoch or rseq is dropped, counted in Stats.UnnumberedRel),
//     or (reason node_lost) once its node
//     is lost and a lease has passed since the later of the node's last
//     sign of life and the client's last publish to it (if only the
//     engine's link failed, the node heard the engine until that publish
//     reached it), a restart shown by another boot's reply included (a
//     restart that overlaps the old process, or a node id run twice,
//     would otherwise free blocks under its copies). Nothing is published to a lost node before then: Flush
//     discards, no heartbeat goes out, Lookup and Load fail (ErrNoNode).
//     While the node has forgotten the engine (an engine_gone release or an
//     "unknown engine" heartbeat reply) and a re-register is pending, an
//     engine_gone release answers every release its request is owed, and
//     a later finished or preempted of a request the node holds nothing of
//     (its engine_gone came, or no batch carrying it was published since) is answered
//     at once with reason engine_gone (no epoch), as the node may refuse
//     the engine for long (--max-engines), and so, when the node forgets
//     the engine, is every such request already owed a release (its step
//     unsent: discarded from then on); one the node may still copy
//     for waits for its engine_gone (the node answers "unknown engine" as
//     soon as it drops the engine, before its copies end). One that
//     comes after the re-register took effect, its resync not yet begun,
//     frees what it answers and calls for no second register.
//     Each such event is answered exactly once through Config.OnReleased;
//   - request ids: Added refuses one the protocol does not allow
//     (ErrBadRequestID: empty, over 256 bytes, not UTF-8), and events naming
//     it are not sent, so none waits for a release;
//   - hashes: Hashes refuses an empty hash or one over 64 bytes
//     (ErrBadHash), the node's bad_hash (Lookup and Load pass theirs on:
//     the node answers a bad one with an error);
//   - counts: every event method taking one refuses a negative count or
//     start, a group the spec lacks, a block id at or past the spec's
//     num_gpu_blocks, or hashes or block ids past what the spec's
//     max_model_len lets a request hold (sched.NewLayout's bounds, the node's)
//     (ErrOutOfRange), before recording anything: the node would reject
//     the event (out_of_range, bad_group, block_range, too_large) and
//     change nothing, so a finished would never be released and every
//     resync would re-announce the bad value;
//   - the mirror: what the engine told it about every live request (prompt,
//     hashes, block ids per group, tokens, phase), which is what a resync
//     re-announces without the engine's help;
//   - load replies: a Load settles only on a reply naming the node it was
//     sent to (any boot of it: the old process of a newer boot copies
//     nothing more) or no responders; a reply naming another node is
//     logged and passed over, since on a cluster every node receives the
//     load and another's word says nothing of the copy its own node may
//     still be writing;
//   - loads in doubt: a Load that got no reply by its deadline returns a
//     *LoadInDoubtError (errors.Is ErrLoadInDoubt). The node never abandons
//     a load, so the engine must not reuse its destination blocks until
//     the error's Settled channel closes: on the load's own late reply, on
//     the loss of its node once its frees are done (the node's fence; only
//     for a load whose flush came back, so none of it can still be in the
//     connection's reconnect buffer), on another boot of that node
//     answering the engine's register (its old process can copy nothing;
//     another boot seen in a heartbeat's, lookup's or load's reply makes the
//     node lost, and such loads settle with that loss's frees, a lease
//     later), or
//     when Close's unregister is answered by that node (it waits for loads
//     in flight). A heartbeat is no proof. Load sends nothing while the
//     node is lost, nor while it has forgotten the engine and a
//     re-register is pending (ErrNoNode): a load sent after such a register
//     could reach a new boot that knows the engine, while the register's
//     reply settles the loads of the old boot.
//
// On a cluster, an engine whose KV cache is CUDA memory (cuda_ipc segments)
// must name its node in Config.Spec.Node: a CUDA IPC handle does not say
// which host it is from, so every node refuses such a register naming none
// (docs/CLUSTER.md); an shm engine may leave it empty (the node whose host
// has its segments claims it).
//
// The engine's NATS connection must use the inbox prefix `_INBOX.<engine>`:
// the node answers an engine's requests only there, and per-engine NATS
// permissions let it read no other (Connect refuses another prefix at once,
// ErrConfig); and, for the
// node_lost frees to be safe, no reconnect buffer (a batch published while
// the link is down would otherwise be replayed to a node that is alive
// after all, after its requests were freed) and pings that close a dead
// link within 3/4 of the node's lease: Dial sets all of them, or pass
// Options(engine) to nats.Connect yourself. Their pings (2 s, 2
// outstanding) close a dead link within 6 s, which meets that only for a
// lease over 8 s (the node's default is 10 s; --lease accepts down to
// 40 ms): against a shorter lease pass a shorter nats.PingInterval to Dial
// after the defaults (its opts come last and win). CheckConn tells what a
// connection lacks (the inbox prefix included); the client logs it at
// Warn at each register.
//
// Concurrency: every method is safe for concurrent use. Callbacks run one
// at a time, in arrival order, on one goroutine of the client, never on a
// NATS goroutine; a slow callback delays later callbacks, not NATS. A
// callback may call the client's event methods but not Close. No goroutine
// of the client outlives Close.
package client
