package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/tracing/natsheader"
)

// subscribe listens for released, stored and resync of this engine and for
// every node's hello and heartbeat (the handlers keep those of its node).
func (c *Client) subscribe() error {
	subs := []struct {
		subject string
		handle  nats.MsgHandler
	}{
		{c.subj + messages.VerbReleased, c.onReleased},
		{c.subj + messages.VerbStored, c.onStored},
		{c.subj + messages.VerbResync, c.onResync},
		{c.cfg.Prefix + "." + messages.NodeToken + ".*." + messages.NodeVerbHello, c.onHello},
		{c.cfg.Prefix + "." + messages.NodeToken + ".*." + messages.NodeVerbHeartbeat, c.onNodeHeartbeat},
	}
	for _, s := range subs {
		sub, err := c.nc.Subscribe(s.subject, s.handle)
		if err != nil {
			return fmt.Errorf("client: subscribe %s: %w", s.subject, err)
		}
		// Releases must not be dropped as a slow consumer: the handlers only
		// take a lock and append, so unbounded pending costs memory only
		// while the process is starved.
		_ = sub.SetPendingLimits(-1, -1)
		c.subs = append(c.subs, sub)
	}
	if err := c.nc.Flush(); err != nil {
		return fmt.Errorf("client: flush subscriptions: %w", err)
	}
	return nil
}

func (c *Client) unsubscribe() {
	for _, s := range c.subs {
		_ = s.Unsubscribe()
	}
	c.subs = nil
}

// dropIncoming applies Config.DropIncoming to m, counting a drop.
func (c *Client) dropIncoming(m *nats.Msg) bool {
	if c.cfg.DropIncoming == nil || !c.cfg.DropIncoming(m) {
		return false
	}
	c.mu.Lock()
	c.st.DroppedIncoming++
	c.mu.Unlock()
	return true
}

func (c *Client) onStored(m *nats.Msg) {
	if c.dropIncoming(m) {
		return
	}
	st, err := ingest.DecodeStored(m.Data)
	if err != nil {
		c.cfg.Log.Warn("client: bad stored body", "engine", c.cfg.Engine, "body", string(m.Data), "err", err)
		return
	}
	c.out.push(st)
}

func (c *Client) onResync(m *nats.Msg) {
	if c.dropIncoming(m) {
		return
	}
	var rs messages.Resync
	if err := json.Unmarshal(m.Data, &rs); err != nil {
		c.cfg.Log.Warn("client: bad resync body", "engine", c.cfg.Engine, "body", string(m.Data), "err", err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seenLocked(rs.Node, rs.Boot)
	if rs.Epoch != c.epoch {
		return // about an epoch already left behind
	}
	if rs.Reason == messages.ResyncOverflow && c.resync == "" {
		c.holdLocked(time.Now())
	}
	c.wantResyncLocked(ResyncNode)
}

// holdLocked delays the resync an overflow calls for (Config.OverflowBackoff).
func (c *Client) holdLocked(now time.Time) {
	base, most := c.cfg.OverflowBackoff, c.lease/4
	if base < 0 || most <= 0 {
		return
	}
	if now.Sub(c.lastOverflow) > c.lease {
		c.overflows = 0
	}
	c.overflows++
	c.lastOverflow = now
	wait := min(base, most)
	for i := 1; i < c.overflows && wait < most; i++ {
		wait = min(2*wait, most)
	}
	wait = wait/2 + rand.N(wait/2+1) // [½, 1]: engines overflowed together answer apart
	c.holdUntil = now.Add(wait)
}

func (c *Client) onHello(m *nats.Msg) {
	var h messages.Hello
	if json.Unmarshal(m.Data, &h) == nil {
		c.mu.Lock()
		c.seenLocked(h.Node, h.Boot)
		c.mu.Unlock()
	}
}

func (c *Client) onNodeHeartbeat(m *nats.Msg) {
	var h messages.NodeHeartbeat
	if json.Unmarshal(m.Data, &h) == nil {
		c.mu.Lock()
		c.seenLocked(h.Node, h.Boot)
		c.mu.Unlock()
	}
}

// loseLocked starts the node-loss procedure: every request awaiting a
// release is freed at freeAtLocked, then the engine registers again and
// resyncs.
func (c *Client) loseLocked(why string) {
	c.lost, c.freedLoss = true, false
	c.st.NodeLosses++
	c.cfg.Log.Warn("client: node lost", "engine", c.cfg.Engine, "node", c.node, "boot", c.boot, "why", why,
		"free_at", c.freeAtLocked())
	c.wake()
}

// freeAtLocked is when a lost node's requests may be freed: a lease after
// the later of its last sign of life and this client's last publish to it.
// If only the engine's link failed, the node, still connected, heard the
// engine until that publish reached it, and its fencing counts from then
// (the node starts no copy for an engine silent that long). Recomputed at
// each check, so a publish in flight at the loss postpones it. A node
// shown to have restarted (otherBoot) waits the same: its new boot proves
// the old process gone only while a node id runs one process at a time,
// and an overlapping restart (a surge, a second node started with the
// same id) breaks that; the old process's fence does not.
func (c *Client) freeAtLocked() time.Time {
	from := c.lastSeen
	if t := c.sent.latest(); t.After(from) {
		from = t
	}
	return from.Add(c.lease)
}

// freeLossLocked frees what the lost node held once its fence has passed:
// every request awaiting a release (node_lost), and the loads in doubt it
// covers.
func (c *Client) freeLossLocked() {
	c.freedLoss = true
	// The epoch is left: its releases still to come (the node's own reset
	// after its lapse, engine_gone after it expired this engine) are for
	// requests freed here, and are stale, though the epoch stays current
	// until the resync after the register.
	c.left = c.epoch
	// The fence covers loads that reached NATS; once another boot of the
	// node is up, this boot's process can copy nothing any more.
	c.settleLoadsOfLocked(c.node, c.boot, !c.otherBoot)
	for _, r := range c.reqs {
		c.freeAllLocked(r, Release{Request: r.id, Reason: messages.ReasonNodeLost})
		r.silent = false
	}
}

// loop is the session's clock: heartbeats every lease/4, node-loss checks,
// the lease wait, re-registering and resyncs nobody's Flush picked up.
func (c *Client) loop() {
	defer c.wg.Done()
	c.mu.Lock()
	period := c.lease / 4
	c.mu.Unlock()
	tick := time.NewTicker(period)
	defer tick.Stop()
	// Also wake the moment the lease runs out, so a silent node is noticed
	// at lease_ms, not up to a heartbeat period later, and when an overflow
	// resync's wait ends.
	expiry := time.NewTimer(c.untilExpiry())
	defer expiry.Stop()
	connected := c.connected
	for {
		select {
		case <-c.stop:
			return
		case <-tick.C:
		case <-c.kick:
		case <-expiry.C:
		case _, ok := <-connected:
			// Reconnected: tickOnce sees the count, resyncs and heartbeats
			// now, not up to a period later.
			if !ok {
				connected = nil // the connection closed: nothing more to hear
			}
		}
		if p := c.tickOnce(); p != period && p > 0 {
			period = p
			tick.Reset(period)
		}
		expiry.Reset(c.untilExpiry())
	}
}

// untilExpiry is how long until the node's lease runs out (a period when
// that does not apply: a v1 node, or the node already lost), or until an
// overflow resync's wait ends if sooner.
func (c *Client) untilExpiry() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	d := c.lease / 4
	if c.boot != "" && !c.lost {
		d = max(time.Until(c.lastSeen.Add(c.lease))+time.Millisecond, time.Millisecond)
	}
	if c.resync != "" && !c.holdUntil.IsZero() && !c.lost && !c.reregister && c.nc.IsConnected() {
		// A hold that ended while a heartbeat was waiting for its reply
		// wakes the loop at once, not a period later. Not while the link
		// is down: the resync waits for it too (resyncDueLocked), and the
		// reconnect wakes the loop; a hold ended meanwhile would wake it
		// every millisecond until then.
		d = min(d, max(time.Until(c.holdUntil), 0)+time.Millisecond)
	}
	return d
}

// tickOnce does what is due now and returns the heartbeat period.
func (c *Client) tickOnce() time.Duration {
	now := time.Now()
	c.mu.Lock()
	if n := c.nc.Stats().Reconnects; n != c.reconnects {
		// Our own connection dropped: whatever was in flight may be lost.
		c.reconnects = n
		c.wantResyncLocked(ResyncReconnect)
	}
	if c.boot == "" {
		// A v1 node (no boot in its register reply): no node heartbeats to
		// judge it by and no P.E.heartbeat to send.
		if c.resyncDueLocked(now) && !c.closed {
			c.resyncLocked()
		}
		period := c.lease / 4
		c.mu.Unlock()
		return period
	}
	if !c.lost && now.Sub(c.lastSeen) > c.lease {
		c.loseLocked(fmt.Sprintf("no heartbeat for %v", now.Sub(c.lastSeen).Round(time.Millisecond)))
	}
	if c.lost && !c.freedLoss {
		if free := c.freeAtLocked(); now.Before(free) {
			wait := free.Sub(now)
			c.mu.Unlock()
			if !c.sleep(wait) {
				return 0 // closed
			}
			return c.tickOnce()
		}
		c.freeLossLocked()
	}
	if c.lost || c.reregister {
		c.mu.Unlock()
		c.tryRegister()
		c.mu.Lock()
	}
	if c.resyncDueLocked(now) && !c.lost && !c.reregister && !c.closed {
		c.resyncLocked() // a failed publish leaves a resync due
	}
	if !c.lost && !c.reregister && !c.closed { // Close unregisters: no heartbeat after it began
		// Published under the lock batches are published under, so a resync
		// on another goroutine cannot put the new epoch's first batch ahead
		// of a heartbeat carrying the epoch it ended; only the reply is
		// awaited outside the lock.
		epoch, seq, n := c.epoch, c.seq, c.probeLocked()
		sub, sent, err := c.sendHeartbeatLocked(epoch, seq)
		c.mu.Unlock()
		if err == nil {
			c.heartbeat(epoch, seq, n, sub, sent)
		} else {
			c.cfg.Log.Debug("client: heartbeat", "engine", c.cfg.Engine, "err", err)
		}
		c.mu.Lock()
	}
	period := c.lease / 4
	c.mu.Unlock()
	return period
}

// sleep waits d; false if Close came first.
func (c *Client) sleep(d time.Duration) bool {
	return wait(context.Background(), d, c.stop) == nil
}

// errStopped: wait's stop channel closed first.
var errStopped = errors.New("stopped")

// wait waits d, or until ctx ends (its error) or stop closes (errStopped;
// a nil stop never does): every backoff and period of the client.
func wait(ctx context.Context, d time.Duration, stop <-chan struct{}) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-stop:
		return errStopped
	}
}

// sendHeartbeatLocked publishes P.E.heartbeat {epoch, seq} with a reply
// inbox of its own and returns that inbox's subscription and the send's id
// in c.sent, pending until heartbeat learns whether anyone took it.
// Caller holds c.mu.
func (c *Client) sendHeartbeatLocked(epoch string, seq uint64) (*nats.Subscription, uint64, error) {
	data, err := json.Marshal(messages.HeartbeatRequest{Epoch: epoch, Seq: seq})
	if err != nil {
		return nil, 0, fmt.Errorf("client: encode heartbeat: %w", err)
	}
	sub, err := c.nc.SubscribeSync(c.nc.NewInbox())
	if err != nil {
		return nil, 0, fmt.Errorf("client: heartbeat reply inbox: %w", err)
	}
	_ = sub.AutoUnsubscribe(1)
	if c.beforeHeartbeat != nil {
		c.beforeHeartbeat()
	}
	id := c.sent.begin(time.Now())
	if err := c.nc.PublishMsg(&nats.Msg{Subject: c.subj + messages.VerbHeartbeat, Reply: sub.Subject, Data: data}); err != nil {
		c.sent.end(id, err)
		_ = sub.Unsubscribe()
		return nil, 0, fmt.Errorf("client: publish heartbeat: %w", err)
	}
	return sub, id, nil
}

// noResponders reports whether m is the server's answer that nobody was
// subscribed to a request's subject (status 503, no body).
func noResponders(m *nats.Msg) bool {
	return len(m.Data) == 0 && m.Header != nil && m.Header.Get("Status") == "503"
}

// heartbeat awaits the reply to the heartbeat sent on sub (probe n) and
// acts on it: another boot is a lost node, the registered one shows the
// boots suspected before it older (boots.go), an unknown engine registers
// again, and fewer releases received than the node had published a
// heartbeat ago is a lost release.
func (c *Client) heartbeat(epoch string, seq, n uint64, sub *nats.Subscription, sent uint64) {
	defer func() { _ = sub.Unsubscribe() }()
	var rep messages.HeartbeatReply
	c.mu.Lock()
	period := c.lease / 4
	c.mu.Unlock()
	// Bounded by the period, so a silent node never holds up the loss check.
	ctx, cancel := context.WithTimeout(context.Background(), min(period, c.cfg.RequestTimeout))
	defer cancel()
	m, err := sub.NextMsgWithContext(ctx)
	if errors.Is(err, nats.ErrNoResponders) || (err == nil && noResponders(m)) {
		// No node was subscribed: it took nothing, so this heartbeat does
		// not postpone the frees (a dead node's would, by a lease).
		c.sent.end(sent, nats.ErrNoResponders)
	} else {
		c.sent.end(sent, nil) // answered, or may have been taken
	}
	if err != nil || len(m.Data) == 0 || json.Unmarshal(m.Data, &rep) != nil {
		return // liveness is judged by the node's own heartbeats (no reply, or no responders)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.repliedLocked(rep.Node, rep.Boot, n)
	if rep.Boot != "" && rep.Boot != c.boot {
		return
	}
	if rep.Error != "" {
		if strings.Contains(rep.Error, "unknown engine") {
			c.cfg.Log.Warn("client: the node forgot this engine", "engine", c.cfg.Engine, "err", rep.Error)
			c.forgottenLocked() // wakes at once, not at the next tick: batches are dropped and loads refused until then
		}
		return
	}
	if epoch != c.epoch {
		return
	}
	// Judged against the count of a reply at least half a period old, so a
	// release published before it has surely been handed to onReleased
	// (replies and releases reach different goroutines of the NATS client).
	if !c.hbPrevAt.IsZero() && time.Since(c.hbPrevAt) < period/2 {
		return
	}
	if c.relGot < c.hbPrev {
		c.cfg.Log.Warn("client: lost release", "engine", c.cfg.Engine, "epoch", epoch, "received", c.relGot,
			"node_published", c.hbPrev)
		c.wantResyncLocked(ResyncLostRelease)
	}
	// A batch still not applied a whole period after a heartbeat carried
	// its seq is a lost tail whose resync (the node's answer to that
	// heartbeat) did not arrive.
	if c.tailSeq > 0 {
		switch {
		case rep.Applied >= c.tailSeq:
			c.tailSeq = 0
		case time.Since(c.tailAt) >= period:
			c.cfg.Log.Warn("client: lost tail", "engine", c.cfg.Engine, "epoch", epoch, "applied", rep.Applied,
				"published", c.tailSeq)
			c.wantResyncLocked(ResyncLostTail)
			c.tailSeq = 0
		}
	}
	if c.tailSeq == 0 && rep.Applied < seq {
		c.tailSeq, c.tailAt = seq, time.Now()
	}
	c.hbPrev, c.hbPrevAt = rep.Released, time.Now()
}

// requestCtx does one request/reply on P.E.verb with JSON bodies, bounded
// by ctx and RequestTimeout, carrying ctx's trace context (natsheader.InjectSpan).
func (c *Client) requestCtx(ctx context.Context, verb string, body, reply any) error {
	return c.requestBegun(ctx, c.sent.begin(time.Now()), verb, body, reply)
}

// requestBegun is requestCtx for a request already recorded as begun (id,
// from sends.begin): a caller that checked the node is not lost records it
// under c.mu, so a loss declared before it is sent still counts it.
func (c *Client) requestBegun(ctx context.Context, id uint64, verb string, body, reply any) error {
	data, err := json.Marshal(body)
	if err != nil {
		c.sent.end(id, nats.ErrConnectionClosed) // nothing sent
		return fmt.Errorf("client: encode %s: %w", verb, err)
	}
	msg := &nats.Msg{Subject: c.subj + verb, Data: data}
	natsheader.InjectSpan(ctx, msg)
	ctx, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
	defer cancel()
	m, err := c.nc.RequestMsgWithContext(ctx, msg)
	if errors.Is(err, nats.ErrConnectionClosed) {
		// Also what a request already sent gets when the connection closes
		// while its reply is awaited: count it as sent (later frees, never
		// earlier ones).
		c.sent.end(id, nil)
	} else {
		c.sent.end(id, err)
	}
	if err != nil {
		return fmt.Errorf("client: engine %s: %s: %w", c.cfg.Engine, verb, err)
	}
	if err := json.Unmarshal(m.Data, reply); err != nil {
		return fmt.Errorf("client: engine %s: decode %s reply %q: %w", c.cfg.Engine, verb, m.Data, err)
	}
	return nil
}
