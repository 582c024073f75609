{{/* The name label of the agent's objects (nameOverride). */}}
{{- define "vgpu.name" -}}
{{- default "vgpu-node-agent" .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end }}

{{/* What the release's object names begin with: fullnameOverride, or the release's name. */}}
{{- define "vgpu.base" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- end }}

{{/* The agent's objects: "<release>-node-agent" ("vgpu-node-agent" for the release vgpu, the
     names of charts before these helpers), or fullnameOverride. */}}
{{- define "vgpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{ include "vgpu.base" . }}
{{- else -}}
{{ printf "%s-node-agent" (include "vgpu.base" .) }}
{{- end }}
{{- end }}

{{/* The namespace of the release's namespaced objects (namespaceOverride). */}}
{{- define "vgpu.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end }}

{{/* The agent's service account as the API server names its requests. */}}
{{- define "vgpu.serviceAccountUser" -}}
system:serviceaccount:{{ include "vgpu.namespace" . }}:{{ include "vgpu.fullname" . }}
{{- end }}

{{/* What selects the agent's pods: its name and the release. */}}
{{- define "vgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vgpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* What selects the receiver's pods. */}}
{{- define "vgpu.receiverSelectorLabels" -}}
app.kubernetes.io/name: vgpu-receiver
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* A workload's selector, which Kubernetes cannot change: where the live object (an upgrade from
     a chart whose selectors named no release) selects by other labels, those are kept (its pods
     carry them still); else `labels`. Args: ctx, kind, name, labels. */}}
{{- define "vgpu.keptSelector" -}}
{{- $live := lookup "apps/v1" .kind (include "vgpu.namespace" .ctx) .name -}}
{{- $kept := dig "spec" "selector" "matchLabels" dict $live -}}
{{- if and $kept (not (hasKey $kept "app.kubernetes.io/instance")) -}}
{{ toYaml $kept }}
{{- else -}}
{{ .labels }}
{{- end }}
{{- end }}

{{/* The labels every object of the chart carries. */}}
{{- define "vgpu.labels" -}}
{{ include "vgpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The image, its tag defaulting to the chart's appVersion. */}}
{{- define "vgpu.image" -}}
{{- $repo := required "image.repository is not set: no vgpu image is published yet. Build packaging/image/Dockerfile (docs/deploying.md), push it to a registry your nodes pull from, and set image.repository (and image.tag)" .Values.image.repository -}}
{{ $repo }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Whether the agent speaks HAMi's or Volcano's scheduler protocol (pod and node annotations). */}}
{{- define "vgpu.annotates" -}}
{{- if or (eq .Values.compat "hami") (eq .Values.compat "volcano") }}true{{ end }}
{{- end }}

{{/* The probes' and Service's scheme. */}}
{{- define "vgpu.metricsScheme" -}}
{{- if .Values.metrics.tlsSecret }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}
