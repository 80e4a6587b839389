package node

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// listenHTTP binds the admin address (loopback by default) first thing in
// Start, so a port in use fails the start at once rather than after the
// NATS wait, and serves /healthz from then on (the process answers) while
// every other path, /readyz included, is 503 "starting" until serveAdmin.
func (n *Node) listenHTTP() error {
	if n.cfg.HTTPAddr == HTTPOff {
		return nil
	}
	ln, err := net.Listen("tcp", n.cfg.HTTPAddr)
	if errors.Is(err, syscall.EADDRINUSE) {
		return fmt.Errorf("admin http on %s: address already in use: pick another with --http "+
			"(port 0: any free port; off: no admin server): %w", n.cfg.HTTPAddr, err)
	}
	if err != nil {
		return fmt.Errorf("admin http on %s: %w", n.cfg.HTTPAddr, err)
	}
	n.ln = ln
	starting := http.NewServeMux()
	starting.HandleFunc("/healthz", healthz)
	starting.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "not ready: starting (waiting for NATS and the node id check)", http.StatusServiceUnavailable)
	})
	n.admin.Store(starting)
	n.http = &http.Server{ReadHeaderTimeout: 5 * time.Second,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { n.admin.Load().ServeHTTP(w, r) })}
	go func() {
		if err := n.http.Serve(ln); err != nil && err != http.ErrServerClosed {
			n.log.Error("admin http stopped", "err", err)
		}
	}()
	return nil
}

func healthz(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) }

// serveAdmin installs the admin server's full handler once the node is
// built: /metrics, /healthz, /readyz, /debug/engines and, with --pprof,
// /debug/pprof.
func (n *Node) serveAdmin() {
	if n.http == nil {
		return
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(n.cfg.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", healthz)
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if err := n.Ready(); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	mux.HandleFunc("/debug/engines", n.serveEngines)
	if n.cfg.Pprof {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	n.admin.Store(mux)
}

// adminStatus gathers engine id's status within the bounds P.E.status
// has (takeStatusSlot): an engine at its share, or a node at its bound, is
// answered with the error.
func (n *Node) adminStatus(id string) (StatusReply, error) {
	rec := n.engine(id)
	if rec == nil {
		return StatusReply{}, fmt.Errorf("%w %q", errUnknownEngine, id)
	}
	release, err := n.takeStatusSlot(rec)
	if err != nil {
		return StatusReply{}, err
	}
	defer release()
	return n.Status(id, 2*time.Second)
}

// serveEngines is the status snapshot of every engine (?engine=ID for one):
// one JSON list, the same as encoded whole, but written one engine at a
// time, each snapshot gathered once the one before is written, so the
// node holds one, not --max-engines of them.
func (n *Node) serveEngines(w http.ResponseWriter, r *http.Request) {
	ids := n.Engines()
	if one := r.URL.Query().Get("engine"); one != "" {
		ids = []string{one}
	}
	w.Header().Set("Content-Type", "application/json")
	if len(ids) == 0 {
		_, _ = w.Write([]byte("[]\n"))
		return
	}
	sep := "[\n  "
	for _, id := range ids {
		st, err := n.adminStatus(id)
		if err != nil {
			st.Engine, st.Error = id, err.Error()
		}
		b, err := json.MarshalIndent(st, "  ", "  ")
		if err != nil { // a StatusReply always encodes: a bug, listed as the engine's error
			st = StatusReply{Node: st.Node, Boot: st.Boot}
			st.Engine, st.Error = id, "encoding its status: "+err.Error()
			b, _ = json.MarshalIndent(st, "  ", "  ")
		}
		if _, err := w.Write(append([]byte(sep), b...)); err != nil {
			return // the client left
		}
		sep = ",\n  "
	}
	_, _ = w.Write([]byte("\n]\n"))
}
