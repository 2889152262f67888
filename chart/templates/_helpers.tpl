{{/* Chart name, truncated to the 63-character label limit. */}}
{{- define "ic.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Resource-name prefix: fullnameOverride, else the release name (with the chart name appended unless
the release name contains it). Truncated so that "<prefix>-controller-metrics" stays within 63.
*/}}
{{- define "ic.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 44 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 44 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 44 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ic.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "ic.labels" -}}
helm.sh/chart: {{ include "ic.chart" . }}
app.kubernetes.io/name: {{ include "ic.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: inference-cache
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "controller"). */}}
{{- define "ic.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ic.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Full labels of one component. */}}
{{- define "ic.componentLabels" -}}
{{ include "ic.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "ic.controller.fullname" -}}
{{- printf "%s-controller" (include "ic.fullname" .) -}}
{{- end -}}

{{- define "ic.agent.fullname" -}}
{{- printf "%s-agent" (include "ic.fullname" .) -}}
{{- end -}}

{{/* Service names. */}}
{{- define "ic.grpcService" -}}
{{- include "ic.controller.fullname" . -}}
{{- end -}}
{{- define "ic.metricsService" -}}
{{- printf "%s-metrics" (include "ic.controller.fullname" .) -}}
{{- end -}}
{{- define "ic.agentsService" -}}
{{- printf "%s-agents" (include "ic.controller.fullname" .) -}}
{{- end -}}
{{- define "ic.webhookService" -}}
{{- printf "%s-webhook" (include "ic.fullname" .) -}}
{{- end -}}

{{/* Name of both webhook configurations (mutating and validating): --webhook-config-name. */}}
{{- define "ic.webhookConfigName" -}}
{{- include "ic.fullname" . -}}
{{- end -}}

{{/* cert-manager objects and the serving-certificate Secret. */}}
{{- define "ic.webhookCertificate" -}}
{{- printf "%s-webhook" (include "ic.fullname" .) -}}
{{- end -}}
{{- define "ic.webhookIssuer" -}}
{{- printf "%s-selfsigned" (include "ic.fullname" .) -}}
{{- end -}}
{{- define "ic.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "ic.fullname" .) -}}
{{- end -}}

{{- define "ic.controller.serviceAccountName" -}}
{{- default (include "ic.controller.fullname" .) .Values.controller.serviceAccount.name -}}
{{- end -}}

{{- define "ic.agent.serviceAccountName" -}}
{{- default (include "ic.agent.fullname" .) .Values.agent.serviceAccount.name -}}
{{- end -}}

{{- define "ic.leaseName" -}}
{{- default (include "ic.controller.fullname" .) .Values.controller.leaderElection.leaseName -}}
{{- end -}}

{{/* The agents' controller URL: the headless Service, so the agent resolves every controller
replica and streams to each (every replica serves LookupRoute from its own index). */}}
{{- define "ic.agent.controllerURL" -}}
{{- if .Values.agent.controllerURL -}}
{{- .Values.agent.controllerURL -}}
{{- else -}}
{{- printf "http://%s.%s.svc:%v" (include "ic.agentsService" .) .Release.Namespace .Values.controller.ports.grpc -}}
{{- end -}}
{{- end -}}

{{/* image reference: include with the image values block and the chart context. */}}
{{- define "ic.image" -}}
{{- $img := .image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (default .ctx.Chart.AppVersion $img.tag) -}}
{{- end -}}
{{- end -}}

{{/* host:port with IPv6 literals bracketed. */}}
{{- define "ic.hostPort" -}}
{{- if and (contains ":" .host) (not (hasPrefix "[" .host)) -}}
{{- printf "[%s]:%v" .host .port -}}
{{- else -}}
{{- printf "%s:%v" .host .port -}}
{{- end -}}
{{- end -}}

{{/* Self-signed webhook mode: the Secret through which the replicas share one generated CA and
serving pair (--webhook-tls-secret; the controller gets it, or creates it when absent). Distinct
from the cert-manager Secret so that switching modes never reads the other mode's data. */}}
{{- define "ic.webhookSelfSignedSecret" -}}
{{- printf "%s-webhook-self-signed" (include "ic.fullname" .) -}}
{{- end -}}

{{/* Model cache: the control namespace (bindings, writer Leases, helmModelCache writers, key
Secrets). */}}
{{- define "ic.modelCache.controlNamespace" -}}
{{- default (printf "%s-model-cache" (include "ic.fullname" .)) .Values.modelCache.controlNamespace -}}
{{- end -}}

{{/* Model cache: the catalog ConfigMap (in the release namespace) and its data key. */}}
{{- define "ic.modelCache.catalogName" -}}
{{- default (printf "%s-storage-capabilities" (include "ic.fullname" .)) .Values.modelCache.catalog.name -}}
{{- end -}}
{{- define "ic.modelCache.catalogKey" -}}
catalog.json
{{- end -}}

{{/* Model cache: --model-cache-feature-gates from a map (gate: bool, sorted) or the flag's own
string form. */}}
{{- /* "true" when the ModelCacheEncryption gate is on (featureGates as a map or as the
"Name=bool,…" string the flag takes). */ -}}
{{- define "ic.modelCache.encryption" -}}
{{- $g := .Values.modelCache.featureGates -}}
{{- if kindIs "string" $g -}}
{{- has "ModelCacheEncryption=true" (splitList "," (nospace $g)) -}}
{{- else -}}
{{- and (hasKey $g "ModelCacheEncryption") (index $g "ModelCacheEncryption") | toString -}}
{{- end -}}
{{- end -}}

{{- define "ic.modelCache.featureGates" -}}
{{- $g := .Values.modelCache.featureGates -}}
{{- if kindIs "string" $g -}}
{{- $g -}}
{{- else -}}
{{- $parts := list -}}
{{- range $k := keys $g | sortAlpha -}}
{{- $parts = append $parts (printf "%s=%t" $k (index $g $k)) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}
{{- end -}}

{{/* Model cache: the pre-delete hook that strips binding finalizers (Job, ServiceAccount, Role,
RoleBinding). A Job name longer than 63 characters cannot label its pods: fullname (44) + 17. */}}
{{- define "ic.modelCache.uninstallName" -}}
{{- printf "%s-strip-finalizers" (include "ic.fullname" .) -}}
{{- end -}}

{{/* --kvevent-subscriber-controller: host:port of the headless agents Service unless set. */}}
{{- define "ic.kvEventSubscriber.controller" -}}
{{- if .Values.kvEventSubscriber.controller -}}
{{- .Values.kvEventSubscriber.controller -}}
{{- else -}}
{{- printf "%s.%s.svc:%v" (include "ic.agentsService" .) .Release.Namespace .Values.controller.ports.grpc -}}
{{- end -}}
{{- end -}}

{{/*
Seconds in a Prometheus duration made of d/h/m/s parts ("30m" → 1800, "1h30m" → 5400), for
comparisons against time(); values.schema.json restricts the values it is given to that form.
*/}}
{{- define "ic.durationSeconds" -}}
{{- $unit := dict "d" 86400 "h" 3600 "m" 60 "s" 1 -}}
{{- $total := 0 -}}
{{- range regexFindAll "[0-9]+[dhms]" . -1 -}}
{{- $u := regexFind "[dhms]$" . -}}
{{- $total = add $total (mul (trimSuffix $u . | atoi) (get $unit $u)) -}}
{{- end -}}
{{- $total -}}
{{- end -}}
