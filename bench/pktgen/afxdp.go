package pktgen

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/xdproxy/xdproxy/xdp/afxdp"
)

// AFXDPSender transmits through an AF_XDP socket bound to one queue of the
// generator's interface.
type AFXDPSender struct {
	sock  *afxdp.Socket
	tpl   *Template
	descs []afxdp.Desc
	seq   uint64
	// next is seq for other goroutines: the sequence number of the next
	// frame to be sent (stored once per batch).
	next atomic.Uint64
}

// Next returns the sequence number of the next frame Send will write: a
// test can tell from it how long ago the generator sent a given flow.
func (s *AFXDPSender) Next() uint64 { return s.next.Load() }

// OpenAFXDP binds a copy-mode AF_XDP socket to queue of ifindex (in the
// calling thread's network namespace). No XDP program is needed to
// transmit.
func OpenAFXDP(ifindex, queue int, tpl *Template) (*AFXDPSender, error) {
	cfg := afxdp.DefaultConfig()
	cfg.Mode = afxdp.Copy
	cfg.NeedWakeup = false
	sock, err := afxdp.Open(ifindex, queue, cfg)
	if err != nil {
		return nil, fmt.Errorf("pktgen: %w", err)
	}
	return &AFXDPSender{sock: sock, tpl: tpl, descs: make([]afxdp.Desc, 0, 64)}, nil
}

// Close releases the socket.
func (s *AFXDPSender) Close() error { return s.sock.Close() }

// Send transmits until the budget is spent or stop is closed.
func (s *AFXDPSender) Send(b Budget, stop <-chan struct{}) (Result, error) {
	if b.Duration <= 0 && b.Count == 0 {
		return Result{}, fmt.Errorf("pktgen: budget needs a duration or a count")
	}
	res := Result{Mode: "afxdp", Offered: b.Rate}
	s.seq = b.Seq
	s.next.Store(s.seq)
	batch := batchFor(b.Rate)
	p := newPacer(b.Rate, batch)
	statsBefore, _ := s.sock.Stats()
	frameLen := uint32(s.tpl.Len())
	var end time.Duration
	for k := 0; ; k++ {
		elapsed := time.Since(p.start)
		end = elapsed
		if (b.Duration > 0 && elapsed >= b.Duration) || (b.Count > 0 && res.Sent >= b.Count) {
			break
		}
		if k&63 == 0 {
			select {
			case <-stop:
				return s.finish(res, p, statsBefore, elapsed), nil
			default:
			}
		}
		s.sock.Complete()
		n, w := p.due(elapsed)
		if n == 0 {
			wait(w)
			continue
		}
		n = min(n, uint64(batch))
		if b.Count > 0 {
			n = min(n, b.Count-res.Sent)
		}
		s.descs = s.descs[:0]
		for uint64(len(s.descs)) < n {
			d, ok := s.sock.Alloc()
			if !ok {
				break
			}
			s.tpl.Write(s.sock.Frame(d)[:frameLen], s.seq+uint64(len(s.descs)))
			d.Len = frameLen
			s.descs = append(s.descs, d)
		}
		sent := s.sock.Transmit(s.descs)
		for _, d := range s.descs[sent:] {
			s.sock.Release(d)
		}
		s.seq += uint64(sent)
		s.next.Store(s.seq)
		res.Sent += uint64(sent)
		p.took(uint64(sent))
		if sent == 0 {
			// TX ring full: the kernel is behind; let it drain.
			yield()
		}
	}
	// Wait briefly for the last frames to leave, so Sent is what went out.
	for deadline := time.Now().Add(100 * time.Millisecond); time.Now().Before(deadline); {
		s.sock.Complete()
		if st, err := s.sock.Stats(); err != nil || st.FramesTx == 0 {
			break
		}
		s.sock.Transmit(nil)
		time.Sleep(time.Millisecond)
	}
	return s.finish(res, p, statsBefore, end), nil
}

func (s *AFXDPSender) finish(res Result, p *pacer, before afxdp.Stats, elapsed time.Duration) Result {
	res.finish(elapsed)
	res.Late = p.late
	if st, err := s.sock.Stats(); err == nil {
		res.SendErrors = (st.TxInvalidDescs - before.TxInvalidDescs) + (st.KickErrors - before.KickErrors)
		// Frames still on the TX ring never left.
		if uint64(st.FramesTx) <= res.Sent {
			res.Sent -= uint64(st.FramesTx)
		}
	}
	return res
}
