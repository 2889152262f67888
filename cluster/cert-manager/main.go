// Command cert-manager-local runs cert-manager's own controllers (the self-signed and CA
// issuers, the Certificate state machine, the CertificateRequest approver) and its CA
// injector in one host process against a kubeconfig, for the local control plane of
// scripts/cluster.sh (`up --with-chart --cert-manager`).
//
// Why a main of our own: cert-manager publishes its library (github.com/cert-manager/cert-manager:
// the controllers, which register themselves in controller.Known(), and the CA injector) as a Go
// module, but not its command modules (cmd/controller, cmd/cainjector use replace lines and are
// not on the module proxy). This file only wires those library packages the way cert-manager's
// own commands do; every reconcile is cert-manager's code. Its webhook (defaulting and
// validation of cert-manager's resources) is not run: the CRDs' schemas still apply.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/runtime"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	kscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/clientcmd"
	apireg "k8s.io/kube-aggregator/pkg/apis/apiregistration/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/log/zap"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	cmapi "github.com/cert-manager/cert-manager/pkg/api"
	"github.com/cert-manager/cert-manager/pkg/controller"
	"github.com/cert-manager/cert-manager/pkg/controller/cainjector"
	logf "github.com/cert-manager/cert-manager/pkg/logs"
	"github.com/cert-manager/cert-manager/pkg/util"

	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/approver"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/ca"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificaterequests/selfsigned"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/issuing"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/keymanager"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/readiness"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/requestmanager"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/revisionmanager"
	_ "github.com/cert-manager/cert-manager/pkg/controller/certificates/trigger"
	_ "github.com/cert-manager/cert-manager/pkg/controller/clusterissuers"
	_ "github.com/cert-manager/cert-manager/pkg/controller/issuers"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/ca"
	_ "github.com/cert-manager/cert-manager/pkg/issuer/selfsigned"
)

// The controllers this process runs: what a self-signed or CA Issuer needs end to end.
var controllers = []string{
	"issuers", "clusterissuers",
	"certificates-trigger", "certificates-issuing", "certificates-key-manager",
	"certificates-request-manager", "certificates-readiness", "certificates-revision-manager",
	"certificaterequests-approver",
	"certificaterequests-issuer-selfsigned", "certificaterequests-issuer-ca",
}

func main() {
	// Our own flag set: controller-runtime registers --kubeconfig on the global one.
	flags := flag.NewFlagSet("cert-manager-local", flag.ExitOnError)
	kubeconfig := flags.String("kubeconfig", "", "kubeconfig of the cluster (required)")
	clusterNS := flags.String("cluster-resource-namespace", "cert-manager", "namespace of ClusterIssuer secrets")
	_ = flags.Parse(os.Args[1:])
	if *kubeconfig == "" {
		fmt.Fprintln(os.Stderr, "cert-manager-local: --kubeconfig is required")
		os.Exit(2)
	}
	ctrl.SetLogger(zap.New())
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	ctx = logf.NewContext(ctx, ctrl.Log.WithName("cert-manager"))
	if err := run(ctx, *kubeconfig, *clusterNS); err != nil {
		fmt.Fprintf(os.Stderr, "cert-manager-local: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, kubeconfig, clusterNS string) error {
	factory, err := controller.NewContextFactory(ctx, controller.ContextOptions{
		Kubeconfig:         kubeconfig,
		KubernetesAPIQPS:   20,
		KubernetesAPIBurst: 50,
		IssuerOptions:      controller.IssuerOptions{ClusterResourceNamespace: clusterNS},
		CertificateOptions: controller.CertificateOptions{
			CertificateRequestMinimumBackoffDuration: time.Minute,
			CertificateRequestMaximumBackoffDuration: 5 * time.Minute,
		},
	})
	if err != nil {
		return err
	}
	known := controller.Known()
	var runs []controller.Interface
	for _, name := range controllers {
		fn, ok := known[name]
		if !ok {
			return fmt.Errorf("controller %q is not registered", name)
		}
		c, err := fn(factory)
		if err != nil {
			return fmt.Errorf("building %s: %w", name, err)
		}
		runs = append(runs, c)
	}
	root, err := factory.Build()
	if err != nil {
		return err
	}
	root.KubeSharedInformerFactory.Start(ctx.Done())
	root.SharedInformerFactory.Start(ctx.Done())
	root.HTTP01ResourceMetadataInformersFactory.Start(ctx.Done())

	var wg sync.WaitGroup
	errs := make(chan error, len(runs)+1)
	for _, c := range runs {
		wg.Add(1)
		go func(c controller.Interface) {
			defer wg.Done()
			if err := c.Run(2, ctx); err != nil {
				errs <- err
			}
		}(c)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := runCAInjector(ctx, kubeconfig); err != nil {
			errs <- fmt.Errorf("cainjector: %w", err)
		}
	}()
	go func() { wg.Wait(); close(errs) }()
	// The first failure stops the process (the caller restarts it); a clean shutdown on a
	// signal closes errs with nothing in it.
	if err, failed := <-errs; failed {
		return err
	}
	return nil
}

func runCAInjector(ctx context.Context, kubeconfig string) error {
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return err
	}
	// The injector's server-side apply takes its field manager from the user agent.
	cfg = util.RestConfigWithUserAgent(cfg, "cainjector")
	scheme := runtime.NewScheme()
	utilruntime.Must(kscheme.AddToScheme(scheme))
	utilruntime.Must(cmapi.AddToScheme(scheme))
	utilruntime.Must(apiextv1.AddToScheme(scheme))
	utilruntime.Must(apireg.AddToScheme(scheme))
	utilruntime.Must(admissionv1.AddToScheme(scheme))
	utilruntime.Must(corev1.AddToScheme(scheme))
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme:                 scheme,
		Metrics:                metricsserver.Options{BindAddress: "0"},
		HealthProbeBindAddress: "0",
	})
	if err != nil {
		return err
	}
	if err := cainjector.RegisterAllInjectors(ctx, mgr, cainjector.SetupOptions{
		EnableCertificatesDataSource: true,
		EnabledReconcilersFor: map[string]bool{
			"mutatingwebhookconfiguration":   true,
			"validatingwebhookconfiguration": true,
			"apiservice":                     false,
			"customresourcedefinition":       true,
		},
	}); err != nil {
		return err
	}
	return mgr.Start(ctx)
}
