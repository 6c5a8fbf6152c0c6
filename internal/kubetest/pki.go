package kubetest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"time"
)

// credentials are the files kube-apiserver needs to serve TLS, sign
// service-account tokens and authenticate the test's user.
type credentials struct {
	caPEM          []byte
	token          string
	userToken      string
	servingCert    string
	servingKey     string
	serviceKey     string
	servicePub     string
	tokenAuthFile  string
	caCertFilePath string
}

// The token file holds two users: an admin in system:masters, which bypasses
// RBAC, and a user in no group, whom RBAC grants nothing beyond discovery.
const (
	adminUser        = "kubetest-admin"
	adminGroup       = "system:masters"
	unprivilegedUser = "kubetest-user"
)

// certLifetime is far longer than any test and any benchmark run.
const certLifetime = 30 * 24 * time.Hour

// writeCredentials generates a CA, a serving certificate for 127.0.0.1 and
// the in-cluster names of the API server (including its Service IP, the first
// address of serviceCIDR), a service-account key pair and a token file.
func writeCredentials(dir string, serviceCIDR netip.Prefix) (*credentials, error) {
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	caTemplate := &x509.Certificate{
		SerialNumber:          randomSerial(),
		Subject:               pkix.Name{CommonName: "kubetest-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(certLifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTemplate, caTemplate, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("create CA certificate: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}

	servingKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	servingTemplate := &x509.Certificate{
		SerialNumber: randomSerial(),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(certLifetime),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default",
			"kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
		IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback,
			serviceCIDR.Masked().Addr().Next().AsSlice()},
	}
	servingDER, err := x509.CreateCertificate(rand.Reader, servingTemplate, ca, &servingKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("create serving certificate: %w", err)
	}

	serviceKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	servicePub, err := x509.MarshalPKIXPublicKey(&serviceKey.PublicKey)
	if err != nil {
		return nil, err
	}

	c := &credentials{
		caPEM:          pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		token:          randomToken(),
		userToken:      randomToken(),
		caCertFilePath: filepath.Join(dir, "ca.crt"),
		servingCert:    filepath.Join(dir, "apiserver.crt"),
		servingKey:     filepath.Join(dir, "apiserver.key"),
		serviceKey:     filepath.Join(dir, "service-account.key"),
		servicePub:     filepath.Join(dir, "service-account.pub"),
		tokenAuthFile:  filepath.Join(dir, "tokens.csv"),
	}
	servingKeyPEM, err := privateKeyPEM(servingKey)
	if err != nil {
		return nil, err
	}
	serviceKeyPEM, err := privateKeyPEM(serviceKey)
	if err != nil {
		return nil, err
	}
	files := []struct {
		path string
		data []byte
	}{
		{c.caCertFilePath, c.caPEM},
		{c.servingCert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: servingDER})},
		{c.servingKey, servingKeyPEM},
		{c.serviceKey, serviceKeyPEM},
		{c.servicePub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: servicePub})},
		// token,user,uid,"group,..."
		{c.tokenAuthFile, fmt.Appendf(nil, "%s,%s,%s,%q\n%s,%s,%s\n",
			c.token, adminUser, adminUser, adminGroup,
			c.userToken, unprivilegedUser, unprivilegedUser)},
	}
	for _, f := range files {
		if err := os.WriteFile(f.path, f.data, 0o600); err != nil {
			return nil, err
		}
	}
	return c, nil
}

func privateKeyPEM(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

func randomSerial() *big.Int {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return serial
}

func randomToken() string {
	b := make([]byte, 24)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return hex.EncodeToString(b)
}
