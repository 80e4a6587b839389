package client

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/kvactors/kvactors/messages"
)

// Lookup asks how many leading tokens of a prompt with these block hashes
// (lowercase hex) the node can load. The request carries the W3C trace
// context of ctx, if any, so the node's kvactors.lookup span is a child of
// the caller's. While the node is lost it sends
// nothing and fails at once (ErrNoNode): every message to the node
// postpones the node_lost frees (checklist step 15). After Close it sends
// nothing either (the engine is unregistered), as Load.
func (c *Client) Lookup(ctx context.Context, hashes []string) (int, error) {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return 0, fmt.Errorf("client: engine %s: lookup after Close", c.cfg.Engine)
	}
	if c.lost {
		node := c.node // a register may change it once unlocked
		c.mu.Unlock()
		return 0, fmt.Errorf("client: engine %s: lookup: %w (node %s)", c.cfg.Engine, ErrNoNode, node)
	}
	n := c.probeLocked()
	// Recorded as begun under c.mu: a loss declared before the send waits
	// for it (step 15), as a Load's does.
	id := c.sent.begin(time.Now())
	c.mu.Unlock()
	var rep messages.LookupReply
	if err := c.requestBegun(ctx, id, messages.VerbLookup, messages.LookupRequest{Hashes: hashes}, &rep); err != nil {
		return 0, err
	}
	c.mu.Lock()
	c.repliedLocked(rep.Node, rep.Boot, n)
	c.mu.Unlock()
	if rep.Error != "" {
		return 0, fmt.Errorf("client: engine %s: lookup: %s", c.cfg.Engine, rep.Error)
	}
	return rep.HitTokens, nil
}

// Close unregisters the engine (the node releases every request with reason
// engine_gone and unmaps its segments), stops the session and waits for
// its goroutines. Callbacks still queued are not delivered. Close must not
// be called from a callback. A re-register in flight is waited for (up to
// RequestTimeout): if it succeeds, Close unregisters that registration.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	close(c.stop)
	c.wg.Wait()
	c.nc.RemoveStatusListener(c.connected)
	// Judged once the session loop has stopped: a re-register it was
	// waiting on may have succeeded, and that registration needs its
	// unregister. A v1 node has no unregister; a lost node or one that
	// forgot the engine (a re-register pending) would only answer with an
	// error.
	c.mu.Lock()
	lost := c.lost || c.reregister || c.boot == ""
	c.mu.Unlock()
	var err error
	if !lost {
		var rep messages.UnregisterReply
		ctx, cancel := context.WithTimeout(context.Background(), min(c.cfg.RequestTimeout, 5*time.Second))
		err = c.unregister(ctx, &rep)
		cancel()
		if err == nil {
			// The node answers an unregister once its loads in flight are
			// done: those sent to it are settled.
			c.mu.Lock()
			c.settleLoadsOfLocked(rep.Node, rep.Boot, false)
			c.mu.Unlock()
		}
	}
	c.mu.Lock()
	c.stopWatchingLoadsLocked()
	c.mu.Unlock()
	c.unsubscribe()
	c.out.close()
	return err
}

// unregister requests P.E.unregister until the node takes it or ctx ends:
// a reply "node overloaded" (its full intake dropped the request unread)
// is tried again after a short backoff, as a register is; left unsent,
// the node would keep the engine and its segments until it expires.
func (c *Client) unregister(ctx context.Context, rep *messages.UnregisterReply) error {
	backoff := 25 * time.Millisecond
	for {
		*rep = messages.UnregisterReply{}
		if err := c.requestCtx(ctx, messages.VerbUnregister, struct{}{}, rep); err != nil {
			return err
		}
		if rep.Error == "" {
			return nil
		}
		if !strings.HasPrefix(rep.Error, overloadedReply) {
			return fmt.Errorf("client: engine %s: unregister: %s", c.cfg.Engine, rep.Error)
		}
		if err := wait(ctx, backoff, nil); err != nil {
			return fmt.Errorf("client: engine %s: unregister: %w (last: %s)", c.cfg.Engine, err, rep.Error)
		}
		backoff = min(2*backoff, 500*time.Millisecond)
	}
}
