{{/* Names and labels shared by every template. */}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-pdserve, or the release name when it already says pdserve; 63 chars max (DNS label). */}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end }}

{{/* Selector labels: stable across upgrades; pass (dict "ctx" . "component" "operator"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-operator" (include "pdserve.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdserve.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{- define "pdserve.natsName" -}}
{{- printf "%s-nats" (include "pdserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The NATS URL workers use: the in-cluster server, or the external one. */}}
{{- define "pdserve.natsUrl" -}}
{{- if .Values.nats.enabled }}
{{- printf "nats://%s.%s.svc.%s:4222" (include "pdserve.natsName" .) .Release.Namespace .Values.clusterDomain }}
{{- else }}
{{- required "nats.external.url is required when nats.enabled=false" .Values.nats.external.url }}
{{- end }}
{{- end }}

{{/* Secret with keys user/password for NATS. */}}
{{- define "pdserve.natsSecretName" -}}
{{- if .Values.nats.enabled }}
{{- printf "%s-credentials" (include "pdserve.natsName" .) }}
{{- else }}
{{- required "nats.external.existingSecret is required when nats.enabled=false" .Values.nats.external.existingSecret }}
{{- end }}
{{- end }}

{{- define "pdserve.webhookName" -}}
{{- printf "%s-webhook" (include "pdserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Secret holding the NATS server's users.conf (a user per InferenceService, kept by the operator). */}}
{{- define "pdserve.natsUsersSecretName" -}}
{{- printf "%s-users" (include "pdserve.natsName" .) }}
{{- end }}

{{/* The first users.conf: the chart's own user, the metrics adapter's read-only observer
(operator/natsusers.py renders the same text; tests/test_chart.py holds them equal). */}}
{{- define "pdserve.natsChartUsers" -}}
users: [
  {"user": $NATS_USER, "password": $NATS_PASSWORD, "permissions": {"publish": {"deny": [">"]}, "subscribe": {"allow": ["pdserve.v2.load.>", "pdserve.v2.bye.>"]}}}
]
{{ end }}
