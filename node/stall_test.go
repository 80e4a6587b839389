package node_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// stall is a loopback TCP proxy to a NATS server whose two directions can
// be held separately, with TCP up: what a stalled link (retransmissions,
// a paused peer) does, unlike a cut one. Bytes read while a direction is
// held wait in the proxy and are delivered, in order, when it resumes.
type stall struct {
	addr string

	mu   sync.Mutex
	cond *sync.Cond
	held [2]bool  // toNode, toServer
	read [2]int64 // bytes read from each side so far
}

const (
	toNode = iota
	toServer
)

func newStall(t *testing.T, target string) *stall {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &stall{addr: ln.Addr().String()}
	s.cond = sync.NewCond(&s.mu)
	t.Cleanup(func() { _ = ln.Close(); s.hold(toNode, false); s.hold(toServer, false) })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			srv, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			go s.pipe(c, srv, toNode)
			go s.pipe(srv, c, toServer)
		}
	}()
	return s
}

func (s *stall) pipe(dst, src net.Conn, dir int) {
	var queue [][]byte // read, not yet written
	done := false
	go func() {
		for {
			buf := make([]byte, 64<<10)
			n, err := src.Read(buf)
			s.mu.Lock()
			if n > 0 {
				s.read[dir] += int64(n)
				queue = append(queue, buf[:n])
			}
			if err != nil {
				done = true
			}
			s.cond.Broadcast()
			s.mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	for {
		s.mu.Lock()
		for (s.held[dir] || len(queue) == 0) && !(done && len(queue) == 0) {
			s.cond.Wait()
		}
		if len(queue) == 0 { // done
			s.mu.Unlock()
			_ = dst.Close()
			return
		}
		chunk := queue[0]
		queue = queue[1:]
		s.mu.Unlock()
		if _, err := dst.Write(chunk); err != nil {
			return
		}
	}
}

func (s *stall) hold(dir int, held bool) {
	s.mu.Lock()
	s.held[dir] = held
	s.mu.Unlock()
	s.cond.Broadcast()
}

func (s *stall) bytesRead(dir int) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.read[dir]
}

// PROTOCOL.md "Lapse": a load the engine sent while the node's link was
// stalled, which reached NATS (an SDK counts it as covered by the node's
// fence once the node is given up), waits in the node's socket behind the
// stall. The link recovers towards the server first, so the round trip that
// ends the lapse is answered behind the load; the load is still a session
// of the lapse, and its copy never starts, however the node's goroutines
// race on the two messages (the test takes the load after the lapse's end).
func TestALoadThatWaitedThroughALapseNeverCopies(t *testing.T) {
	t.Parallel()
	const lease = 2 * time.Second
	srv := testkit.NATSServer(t)
	link := newStall(t, srv.Addr().String())
	dev := &heldDevice{started: make(chan struct{}, 8), gate: make(chan struct{}, 8)}
	reg := prometheus.NewRegistry()
	dir := t.TempDir()
	stops := make(chan string, 1)
	n, err := node.Start(context.Background(), node.Config{NATSURL: "nats://" + link.addr, ShmDir: dir,
		PoolBytes: 1 << 20, HTTPAddr: "off", Registry: reg, Lease: lease,
		Log:        slog.New(slog.NewTextHandler(io.Discard, nil)),
		WrapDevice: func(d backend.Attachment) backend.Attachment { dev.Attachment = d; return dev },
		FailStop:   func(reason string) { stops <- reason }})
	require.NoError(t, err)
	t.Cleanup(func() { close(dev.gate); _ = n.Close(context.Background()) })
	e := &env{t: t, node: n, reg: reg, dir: dir, nc: testkit.Connect(t, srv)}
	te := e.newEngine("e1", defaultOpts())
	te.register()
	te.send(added("a", 4), hashesEv("a", 0, hash("a", 0)), blocksEv("a", 0, 0, 1), tokensEv("a", 4, 4),
		finishedEv("a", false, 4, 4))
	testkit.Recv(t, dev.started, 5*time.Second, "a's store copy")
	dev.gate <- struct{}{}
	recv(t, te.stored, "a stored")
	recv(t, te.released, "a released")
	reply := make(chan *nats.Msg, 1)
	inbox := testkit.EngineInbox("e1")
	_, err = e.nc.ChanSubscribe(inbox, reply)
	require.NoError(t, err)
	te.heartbeat("ep1", 1) // the node's last sign of the engine before the stall
	require.NoError(t, e.nc.Flush())

	link.hold(toNode, true)
	link.hold(toServer, true)
	body, _ := json.Marshal(map[string]any{"request": "l", "hashes": []string{hash("a", 0)}, "num_tokens": 4,
		"blocks": [][]int{{9}}})
	sentAt := link.bytesRead(toNode)
	require.NoError(t, e.nc.PublishRequest("kvactors.e1.load", inbox, body))
	require.NoError(t, e.nc.Flush()) // the load reached the server
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if link.bytesRead(toNode) == sentAt {
			return fmt.Errorf("the load has not reached the held link")
		}
		return nil
	})
	testkit.Eventually(t, 5*lease, 5*time.Millisecond, func() error {
		if v := metricValue(t, reg, "kvactors_transfer_fence_lapses_total", nil); v < 1 {
			return fmt.Errorf("no lapse recorded yet")
		}
		return nil
	})
	// Towards the server first: the node's pings go through, and the
	// server's answers queue up behind the load.
	answered := link.bytesRead(toNode)
	link.hold(toServer, false)
	testkit.Eventually(t, 5*lease, time.Millisecond, func() error {
		if link.bytesRead(toNode) == answered {
			return fmt.Errorf("no answer to the node's ping held behind the load yet")
		}
		return nil
	})
	// nats.go's reader queues the load for the node's subscription, then
	// completes the round trip behind it; the subscription's goroutine may
	// take the load on either side of the lapse's end. The later side, where
	// only the lapse's boundary (ingester.markLapseEnd) tells the load from
	// a fresh one, is made certain: the intake is held before it stamps the
	// load until the round trip has ended the lapse.
	hold := n.HoldIntake()
	t.Cleanup(hold)
	link.hold(toNode, false)
	testkit.Eventually(t, 5*lease, time.Millisecond, func() error {
		if n.Fenced() {
			return fmt.Errorf("no round trip since the lapse yet")
		}
		return nil
	})
	hold()

	select {
	case <-dev.started:
		t.Fatal("the load's copy started after the lapse: the engine may have reused its blocks")
	case m := <-reply:
		// Refused as a session of the lapse, or first as the load that ended
		// its engine's silence of lease/2 (PROTOCOL.md "Engine silence"):
		// either way it never copies.
		if !strings.Contains(string(m.Data), "lapsed") {
			require.Contains(t, string(m.Data), "no load until it begins a new epoch", "refused")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no answer to the load")
	}
	testkit.NoRecv(t, dev.started, 100*time.Millisecond, "the load's copy starting")
	testkit.NoRecv(t, stops, 0, "a fail-stop")
}
