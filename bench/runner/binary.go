package runner

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/xdproxy/xdproxy/bench/kernelrules"
	"github.com/xdproxy/xdproxy/bench/topo"
)

// binaryConfig is the xdproxy config file of the benchmark: both node
// interfaces, one queue each, workers on the forwarding CPU, copy mode.
func binaryConfig(servicesFile, adminSocket string, cpu int) string {
	iface := func(name string) string {
		return fmt.Sprintf(`  - name: %s
    queues: [0]
    cpus: [%d]
    xdpMode: native
    bindMode: copy
`, name, cpu)
	}
	return fmt.Sprintf(`apiVersion: xdproxy.io/v1alpha1
kind: XDProxyConfiguration
nodeName: bench-node
interfaces:
%s%sservices:
  file: %s
clusterCIDR: %s
# The range of the earlier runs, inside the node's ephemeral ports:
# reserved for SNAT while xdproxy runs.
masquerade:
  portRange: 32768-60999
  reservePorts: true
conntrack:
  maxEntries: 1048576
metricsAddress: 127.0.0.1:10249
healthzAddress: 127.0.0.1:10256
adminSocket: %s
batchSize: 64
# Room for the largest service count the benchmark loads (100,000).
xdpTables:
  maxFrontends: 262144
  maxAddresses: 524288
`, iface(topo.NodeInIface), iface(topo.NodeOutIface), servicesFile, topo.PodCIDR, adminSocket)
}

// startBinary runs the real xdproxy binary with a config and a services
// file written for this variant, and waits until it has published the
// table.
func (e *env) startBinary(services int, proto kernelrules.Proto) error {
	dir, err := os.MkdirTemp("", "xdproxy-bench-")
	if err != nil {
		return err
	}
	e.closers = append(e.closers, func() error { return os.RemoveAll(dir) })
	var svc bytes.Buffer
	if err := Services(max(services, 1), proto).WriteManifests(&svc); err != nil {
		return err
	}
	svcFile := filepath.Join(dir, "services.yaml")
	cfgFile := filepath.Join(dir, "xdproxy.yaml")
	if err := os.WriteFile(svcFile, svc.Bytes(), 0o644); err != nil {
		return err
	}
	e.admin = filepath.Join(dir, "admin.sock")
	if err := os.WriteFile(cfgFile, []byte(binaryConfig(svcFile, e.admin, e.cfg.Plan.ForwardCPU)), 0o644); err != nil {
		return err
	}
	cmd := exec.Command("ip", "netns", "exec", e.t.Node, "nice", "-n", strconv.Itoa(e.cfg.Nice), e.cfg.XDProxyBin, "run", "--config", cfgFile)
	var logs bytes.Buffer
	e.procErr = &logs
	errPipe, err := cmd.StderrPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	e.proc = cmd
	ready := make(chan error, 1)
	want := "servicePorts=" + strconv.Itoa(max(services, 1))
	go func() {
		sc := bufio.NewScanner(errPipe)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		sent := false
		for sc.Scan() {
			logs.WriteString(sc.Text() + "\n")
			switch {
			case sent:
			case strings.Contains(sc.Text(), "published service table") && strings.Contains(sc.Text(), want):
				ready <- nil
				sent = true
			case strings.Contains(sc.Text(), "level=ERROR"):
				// xdproxy keeps forwarding with its last table when
				// programming fails; for the benchmark that is fatal.
				ready <- fmt.Errorf("xdproxy failed to program %d services: %s", services, sc.Text())
				sent = true
			}
		}
		if !sent {
			ready <- fmt.Errorf("xdproxy exited before publishing %d services: %s", services, tail(logs.String(), 800))
		}
	}()
	select {
	case err := <-ready:
		return err
	case <-time.After(180 * time.Second):
		return fmt.Errorf("xdproxy has not published %d services after 180s: %s", services, tail(logs.String(), 800))
	}
}

func tail(s string, n int) string {
	s = strings.TrimSpace(s)
	if len(s) > n {
		return "..." + s[len(s)-n:]
	}
	return s
}
