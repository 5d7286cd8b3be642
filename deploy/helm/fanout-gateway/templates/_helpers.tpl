{{- define "fanout-gateway.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "fanout-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "fanout-gateway.labels" -}}
{{ include "fanout-gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The Secret the tokens come from: the user's, or the one this chart makes. */}}
{{- define "fanout-gateway.secretName" -}}
{{- .Values.secrets.existingSecret | default (include "fanout-gateway.fullname" .) -}}
{{- end -}}

{{/* drain.preStopSleepSeconds + delaySeconds + timeoutSeconds + marginSeconds, rounded up: the kubelet's SIGKILL
     comes after the whole drain. */}}
{{- define "fanout-gateway.gracePeriod" -}}
{{- $d := .Values.drain -}}
{{- addf $d.preStopSleepSeconds $d.delaySeconds $d.timeoutSeconds $d.marginSeconds | ceil | int -}}
{{- end -}}

{{- define "fanout-gateway.hasBroker" -}}
{{- if or .Values.secrets.brokerUrl .Values.broker.sentinelAddresses .Values.broker.clusterAddresses -}}true{{- end -}}
{{- end -}}
