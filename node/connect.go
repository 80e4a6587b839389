package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
)

// MaxPayload is the embedded server's largest message (and the size P.E.status
// pages to stay under on any server with at least the NATS default of 1 MiB:
// see statusPageBytes).
const MaxPayload = 8 << 20

// portFree reports an embedded NATS port that is already taken as an error
// an operator can act on. Port -1 (any free port) is always free.
func portFree(host string, port int) error {
	if port < 0 {
		return nil
	}
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	ln, err := net.Listen("tcp", addr)
	if err == nil {
		return ln.Close()
	}
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("embedded nats on %s: address already in use: pick a free port with --nats-port "+
			"(-1: any free port) or use a running server with --nats URL: %w", addr, err)
	}
	return fmt.Errorf("embedded nats on %s: %w", addr, err)
}

// Backoff of the first connection's retries.
const (
	connectBackoffMin = 100 * time.Millisecond
	connectBackoffMax = 5 * time.Second
)

// connectWithRetry connects to url, retrying with doubling backoff until
// timeout: a node started before its NATS cluster (a host booting, a
// DaemonSet rolling out first) waits for it rather than exiting. Once
// connected, the client's own reconnect takes over. ctx ends the wait.
func connectWithRetry(ctx context.Context, url string, opts []nats.Option, timeout time.Duration,
	log *slog.Logger) (*nats.Conn, error) {
	deadline := time.Now().Add(timeout)
	backoff := connectBackoffMin
	for attempt := 1; ; attempt++ {
		nc, err := nats.Connect(url, opts...)
		if err == nil {
			return nc, nil
		}
		left := time.Until(deadline)
		if left <= 0 || errors.Is(err, nats.ErrAuthorization) {
			return nil, fmt.Errorf("connect to nats %s (%d attempts in %v): %w", url, attempt, timeout, err)
		}
		wait := min(backoff, left)
		log.Warn("nats not reachable, retrying", "url", url, "attempt", attempt, "in", wait, "err", err)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("connect to nats %s: %w (last error: %w)", url, ctx.Err(), err)
		case <-t.C:
		}
		backoff = min(2*backoff, connectBackoffMax)
	}
}
