package client

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvactors/kvactors/messages"
)

// registerRetry registers until a node answers, ctx ends or Close.
func (c *Client) registerRetry(ctx context.Context) error {
	backoff := 50 * time.Millisecond
	for {
		err := c.registerOnce(ctx, nil)
		if err == nil || errors.Is(err, errRefused) {
			return err
		}
		c.cfg.Log.Debug("client: register", "engine", c.cfg.Engine, "err", err, "retry_in", backoff)
		switch werr := wait(ctx, backoff, c.stop); {
		case errors.Is(werr, errStopped):
			return fmt.Errorf("client: engine %s: closed while registering", c.cfg.Engine)
		case werr != nil:
			return fmt.Errorf("client: engine %s: register: %w (last: %w)", c.cfg.Engine, werr, err)
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

var (
	errRefused = errors.New("register refused")
	// errOverloaded: the node's intake was full and dropped the register
	// unread; it asks to try again, so it is no refusal.
	errOverloaded = errors.New(messages.Overloaded)
)

// overloadedReply starts the error of a reply to a request the node's full
// intake dropped (PROTOCOL.md "Delivery", Overflow: `{"error":"node
// overloaded: …"}`); the wire has no code for it, so its words are the mark.
const overloadedReply = messages.Overloaded

// registerOnce sends the spec; on success the node, boot and lease of the
// reply become the session's, and then (if any) runs in the same step,
// under c.mu: nothing sees the new registration without what then changes.
// ctx (besides RequestTimeout) bounds the wait for the reply.
//
// Registers run one at a time (Connect, then only the session loop), so
// each is sent after the previous one took effect: another boot of the
// node in its reply is a restart (boots.go).
func (c *Client) registerOnce(ctx context.Context, then func()) error {
	c.mu.Lock()
	n := c.probeLocked()
	c.mu.Unlock()
	var rep messages.RegisterReply
	if err := c.requestCtx(ctx, messages.VerbRegister, c.cfg.Spec, &rep); err != nil {
		return err
	}
	if !rep.OK {
		if strings.HasPrefix(rep.Error, overloadedReply) {
			return fmt.Errorf("client: engine %s: register: %w: %s", c.cfg.Engine, errOverloaded, rep.Error)
		}
		return fmt.Errorf("client: engine %s: %w: %s", c.cfg.Engine, errRefused, rep.Error)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.boot != "" && rep.Node == c.node && rep.Boot != c.boot {
		// The node restarted: its old process can copy nothing any more, so
		// its loads in doubt are settled, reached NATS or not. None was sent
		// after this register (loadRefusedLocked), so the new boot copies
		// none of them.
		c.settleLoadsOfLocked(c.node, c.boot, false)
	}
	c.pastBoots = pastBoots(c.pastBoots, c.node, c.boot, rep.Node, rep.Boot)
	if rep.Node == c.node {
		c.pastSuspectsLocked(n, rep.Boot) // seen before the register: older than its answerer
	} else {
		c.suspects = nil
	}
	c.node, c.boot, c.otherBoot, c.regAt = rep.Node, rep.Boot, false, c.probes
	c.lease = time.Duration(rep.LeaseMS) * time.Millisecond
	if c.lease <= 0 {
		c.lease = c.cfg.DefaultLease
	}
	c.lastSeen = time.Now()
	c.st.Registers++
	if then != nil {
		then()
	}
	for _, bad := range CheckConn(c.nc.Opts, c.cfg.Engine, c.lease) {
		c.cfg.Log.Warn("client: the NATS connection does not suit the node's lease", "engine", c.cfg.Engine,
			"lease", c.lease, "problem", bad)
	}
	return nil
}

// tryRegister is one re-register attempt after a loss; success starts a
// new epoch that re-announces every live request.
//
// A refusal is not final here as it is for Connect (checklist step 5): it
// may pass (--max-engines reached until another engine leaves; a cluster
// owner whose lease has not lapsed), and the engine's requests are already
// freed, so the client keeps trying every lease/4. But each refusal is
// counted (Stats.RegisterRefusals, Stats.RegisterRefused), logged at Warn
// when its text changes, and handed to Config.OnRegisterRefused, so an
// engine can see a session that will not come back (say a namespace whose
// geometry changed) and act, e.g. Close.
//
// The session leaves the loss (or the pending re-register) in the step
// that makes the reply's node and boot its own. In two steps, a request
// finished between them was freed node_lost (no node can copy it) though
// the new boot was already the session's.
func (c *Client) tryRegister() {
	var hook func()
	// RequestTimeout bounds the wait; the loss ends in the step that takes the reply.
	err := c.registerOnce(context.Background(), func() {
		hook = c.afterReregister
		c.st.RegisterRefused = ""
		reason := ResyncReregister
		if c.lost {
			reason = ResyncNewBoot
		}
		// A new registration answers any overflow: its resync waits for nothing.
		c.lost, c.reregister, c.resync, c.holdUntil = false, false, reason, time.Time{}
		c.reregIn = c.epoch
	})
	switch {
	case err == nil:
		if hook != nil {
			hook()
		}
		return
	case !errors.Is(err, errRefused):
		c.cfg.Log.Debug("client: re-register", "engine", c.cfg.Engine, "err", err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.st.RegisterRefusals++
	if msg := err.Error(); msg != c.st.RegisterRefused {
		c.st.RegisterRefused = msg
		c.cfg.Log.Warn("client: re-register refused; retrying every lease/4", "engine", c.cfg.Engine,
			"err", err, "refusals", c.st.RegisterRefusals)
	}
	c.out.push(refusal{err})
}
